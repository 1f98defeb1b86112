from torchtitan_moe.train.launch import die_with_launcher

die_with_launcher()  # first: a launcher killed during the imports below takes this process with it

from torchtitan_moe.compat.torchtitan import exit_process  # noqa: E402
from torchtitan_moe.train.trainer import main  # noqa: E402

exit_process(main())

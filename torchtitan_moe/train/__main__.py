from torchtitan_moe.compat.torchtitan import exit_process
from torchtitan_moe.train.trainer import main

exit_process(main())

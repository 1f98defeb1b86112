"""[dispatch] backend = deepep | auto: config checks, the tuned file, and the choice with its reason.

One process, no collectives: DeepEP's group checks (tested in test_deepep.py) are stubbed here.
"""

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.train.job_config import load_job_config
from torchtitan_moe.dispatch import deepep_backend, registry
from torchtitan_moe.parallel import tuned
from torchtitan_moe.parallel.choose import choose_dispatcher
from torchtitan_moe.dispatch.deepep_backend import DeepEPSettings, DeepEPUnavailable, import_deep_ep

from test_config import debug_with
from test_deepep import load_fake_deep_ep

SHAPE = tuned.Shape("NVIDIA H200", 2, 2048, 8, 128, 8192)


def entry(best="deepep", tokens=8192, num_sms=64, gpu="NVIDIA H200", all_gather_ms=None) -> dict:
    layer_ms = {"deepep": 9.5, "all_to_all": 12.0} | ({"all_gather": all_gather_ms} if all_gather_ms else {})
    return {"gpu": gpu, "ep": 2, "hidden": 2048, "top_k": 8, "experts": 128, "tokens_per_rank": tokens, "best": best,
            "deepep": {"num_sms": num_sms, "dispatch_chunk": 16, "combine_chunk": 8, "buffer_tokens": 256},
            "layer_ms": layer_ms, "dispatch_combine_ms": {"deepep": 0.8, "all_to_all": 2.9}}


def write_tuned(tmp_path: Path, *entries: dict, version=1) -> str:
    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps({"version": version, "entries": list(entries)}))
    return str(path)


def cfg(backend="auto", tuned_file="", num_sms=0, precision="bfloat16", overlap="none"):
    return SimpleNamespace(dispatch=SimpleNamespace(backend=backend, tuned_file=tuned_file, num_sms=num_sms, overlap=overlap,
                                                    buffers="exact"),
                           training=SimpleNamespace(mixed_precision_param=precision))


@pytest.fixture
def fake_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", load_fake_deep_ep())
    monkeypatch.setattr(deepep_backend, "check_group", lambda group: None)  # one host, peers reachable


@pytest.fixture
def no_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` raises ImportError


# -- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"dispatch__backend": "deepep"}, "[dispatch] backend = 'deepep' needs [parallelism] expert_parallel_degree 2, 4 or 8"),
        ({"dispatch__backend": "deepep", "parallelism__expert_parallel_degree": 2},
         "[dispatch] backend = 'deepep' needs [training] mixed_precision_param = 'bfloat16'"),
        ({"dispatch__num_sms": 7}, "[dispatch] num_sms = 7: must be 0"),
        ({"dispatch__num_sms": 32, "dispatch__backend": "all_to_all", "parallelism__expert_parallel_degree": 2},
         "[dispatch] num_sms = 32 sets DeepEP's SMs: it needs backend = 'deepep' or 'auto'"),
        ({"dispatch__backend": "nvshmem"}, "[dispatch] backend = 'nvshmem': expected 'auto' | 'local' | 'all_to_all' | 'deepep'"),
    ],
)
def test_bad_dispatch_config_is_one_line(tmp_path, changes, expected):
    with pytest.raises(ConfigError) as err:
        load_job_config(["--job.config_file", debug_with(tmp_path, **changes)])
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_deepep_config_passes(tmp_path):
    path = debug_with(tmp_path, dispatch__backend="deepep", parallelism__expert_parallel_degree=2,
                      training__mixed_precision_param="bfloat16", dispatch__num_sms=64)
    config = load_job_config(["--job.config_file", path])
    assert config.dispatch.backend == "deepep" and config.dispatch.num_sms == 64
    assert config.dispatch.tuned_file == ""  # the shipped table alone


def test_the_shipped_table_answers_without_a_file_and_a_users_file_comes_first(tmp_path):
    h200 = tuned.Shape("NVIDIA H200", 2, 2048, 8, 128, 8192)
    source, _, shipped = tuned.lookup("", h200)
    assert source == tuned.SHIPPED and shipped.best == "deepep"  # measured on 2 H200s, see tuned.py
    assert tuned.lookup("", tuned.Shape("NVIDIA H100 80GB HBM3", 2, 2048, 8, 128, 8192)) is None
    mine = write_tuned(tmp_path, {**entry(num_sms=32), "best": "all_to_all"})
    source, index, found = tuned.lookup(mine, tuned.Shape("NVIDIA H200", 2, 2048, 8, 128, 16384))
    assert (source, index, found.best, found.deepep.num_sms) == (mine, 0, "all_to_all", 32)


def test_a_tuned_file_that_does_not_exist_is_refused(tmp_path):
    missing = str(tmp_path / "typo.json")
    with pytest.raises(ConfigError, match=r"^\[dispatch\] tuned_file = .*typo.json.: no such file \(leave it unset"):
        choose_dispatcher(cfg("auto", missing), tuned.Shape("NVIDIA H200", 2, 2048, 8, 128, 8192), None, device_sms=132)


# -- the tuned file ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{not json", "cannot read it as JSON"),
        (json.dumps({"version": 1, "entries": [entry(num_sms=63)]}), "entry 0: deepep num_sms = 63: must be an even"),
        (json.dumps({"version": 1, "entries": [entry(), {**entry(), "best": "nccl"}]}), "entry 1: best = 'nccl'"),
        (json.dumps({"version": 1, "entries": [{k: v for k, v in entry().items() if k != "layer_ms"}]}),
         "entry 0: missing key 'layer_ms'"),
        (json.dumps({"version": 2, "entries": []}), "version 2, this code reads 1"),
        (json.dumps([entry()]), 'expected {"version": 1, "entries": [...]}'),
    ],
)
def test_a_tuned_file_that_does_not_parse_is_refused(tmp_path, content, expected):
    path = tmp_path / "dispatch.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        tuned.load(str(path))
    message = str(err.value)
    assert f"[dispatch] tuned_file = {str(path)!r}" in message and expected in message and "\n" not in message


def test_an_entry_with_more_sms_than_the_gpu_is_refused(tmp_path):
    path = write_tuned(tmp_path, entry(num_sms=128), entry(num_sms=200, tokens=16384))
    with pytest.raises(ConfigError, match=r"entry 1: num_sms = 200 but this NVIDIA H200 has 132 SMs"):
        choose_dispatcher(cfg("auto", path), tuned.Shape("NVIDIA H200", 2, 2048, 8, 128, 16384), None, device_sms=132)


def test_match_takes_the_nearest_tokens_within_a_factor_of_2():
    entries = [tuned._entry(e, "e") for e in (entry(tokens=4096), entry(tokens=16384), entry(gpu="NVIDIA H100"))]
    assert tuned.match(entries, SHAPE)[0] == 0  # 4096 and 16384 are both 2x away: the first wins
    assert tuned.match(entries, tuned.Shape("NVIDIA H200", 2, 2048, 8, 128, 12000))[0] == 1
    assert tuned.match(entries, tuned.Shape("NVIDIA H200", 2, 2048, 8, 128, 40000)) is None
    assert tuned.match(entries, tuned.Shape("NVIDIA H200", 4, 2048, 8, 128, 8192)) is None


def test_save_replaces_the_entry_of_the_same_shape(tmp_path):
    path = str(tmp_path / "sub" / "dispatch.json")
    first = tuned._entry(entry(), "e")
    tuned.save(path, first)
    tuned.save(path, tuned._entry(entry(tokens=16384), "e"))
    tuned.save(path, tuned._entry(entry(num_sms=32, best="all_to_all"), "e"))
    loaded = tuned.load(path)
    assert [(e.shape.tokens_per_rank, e.deepep.num_sms, e.best) for e in loaded] == [(8192, 32, "all_to_all"),
                                                                                     (16384, 64, "deepep")]


# -- the choice -------------------------------------------------------------------------------


def test_deepep_without_deep_ep_says_how_to_install(no_deep_ep):
    with pytest.raises(ConfigError) as err:
        choose_dispatcher(cfg("deepep"), SHAPE, None, device_sms=132)
    message = str(err.value)
    assert message.startswith("[dispatch] backend = 'deepep': the deep_ep package cannot be imported")
    assert "bash scripts/install_deepep.sh" in message and "\n" not in message


def test_deep_ep_without_the_v1_api_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", SimpleNamespace(__file__="/x/deep_ep/__init__.py", ElasticBuffer=1))
    with pytest.raises(DeepEPUnavailable, match="lacks the v1 Buffer API"):
        import_deep_ep()


def test_deepep_refuses_shapes_its_kernels_cannot_take(fake_deep_ep):
    with pytest.raises(ConfigError, match="hidden size 2050: DeepEP needs a multiple of 16"):
        choose_dispatcher(cfg("deepep"), tuned.Shape("NVIDIA H200", 2, 2050, 8, 128, 8192), None, 132)
    with pytest.raises(ConfigError, match="512 experts per EP rank: DeepEP takes at most 128"):
        choose_dispatcher(cfg("deepep"), tuned.Shape("NVIDIA H200", 2, 2048, 8, 1024, 8192), None, 132)


def test_deepep_takes_the_tuned_settings_else_deepeps_defaults(tmp_path, fake_deep_ep):
    path = write_tuned(tmp_path, entry())
    choice = choose_dispatcher(cfg("deepep", path), SHAPE, None, 132)
    assert choice.settings == DeepEPSettings(64, 16, 8) and "tuned for 8192 tokens/rank" in choice.reason
    choice = choose_dispatcher(cfg("deepep", path), tuned.Shape("NVIDIA H200", 4, 2048, 8, 128, 8192), None, 132)
    assert choice.settings == DeepEPSettings(24, 6, 9) and "DeepEP's defaults" in choice.reason
    choice = choose_dispatcher(cfg("deepep", path, num_sms=32), SHAPE, None, 132)
    assert choice.settings == DeepEPSettings(32, 24, 10) and "[dispatch] num_sms" in choice.reason
    with pytest.raises(ConfigError, match=r"\[dispatch\] num_sms = 140: this NVIDIA H200 has 132 SMs"):
        choose_dispatcher(cfg("deepep", path, num_sms=140), SHAPE, None, 132)


def test_auto_picks_from_the_tuned_table_and_says_why(tmp_path, fake_deep_ep):
    choice = choose_dispatcher(cfg("auto", write_tuned(tmp_path, entry())), SHAPE, None, 132)
    assert (choice.backend, choice.settings) == ("deepep", DeepEPSettings(64, 16, 8))
    assert choice.reason.startswith("auto: deepep, the fastest in") and "deepep 9.50 ms vs all_to_all 12.00 ms" in choice.reason

    choice = choose_dispatcher(cfg("auto", write_tuned(tmp_path, entry(best="all_to_all"))), SHAPE, None, 132)
    assert choice.backend == "all_to_all" and choice.reason.startswith("auto: all_to_all, the fastest in")

    h100 = tuned.Shape("NVIDIA H100 80GB HBM3", *list(dataclasses.astuple(SHAPE))[1:])  # not in the shipped table
    choice = choose_dispatcher(cfg("auto", write_tuned(tmp_path, entry(tokens=65536))), h100, None, 132)
    assert choice.backend == "all_to_all" and "no tuned entry for NVIDIA H100 80GB HBM3, EP 2" in choice.reason
    assert "or the shipped table" in choice.reason and "python -m torchtitan_moe.tools.tune_dispatch" in choice.reason

    choice = choose_dispatcher(cfg("auto"), tuned.Shape("cpu", 1, 128, 2, 8, 1024), None, None)
    assert (choice.backend, choice.reason) == ("local", "local (EP = 1)")


def test_auto_picks_all_gather_where_it_is_the_fastest_and_this_run_can_use_it(tmp_path, fake_deep_ep, monkeypatch):
    path = write_tuned(tmp_path, entry(best="all_gather", all_gather_ms=9.0))
    choice = choose_dispatcher(cfg("auto", path), SHAPE, None, None)
    assert (choice.backend, choice.settings) == ("all_gather", None)
    assert choice.reason.startswith("auto: all_gather, the fastest in") and "all_gather 9.00 ms" in choice.reason
    # Where it cannot run, the faster of the two others, saying why.
    choice = choose_dispatcher(cfg("auto", path, overlap="chunks"), SHAPE, None, None)
    assert choice.backend == "deepep" and choice.reason.startswith("auto: deepep, the fastest this run can use in")
    assert "; not all_gather: needs [dispatch] overlap = 'none' (its exchanges finish where they start), got 'chunks'" \
        in choice.reason
    monkeypatch.setattr(registry, "peers_problem", lambda group: "GPU 0 cannot access GPU 1 (no P2P/NVLink between them)")
    choice = choose_dispatcher(cfg("auto", path), SHAPE, object(), 132)  # a GPU run: the peers are asked
    assert choice.backend == "deepep" and "; not all_gather: GPU 0 cannot access GPU 1" in choice.reason
    slower = write_tuned(tmp_path, entry(best="all_gather", all_gather_ms=9.0) | {"layer_ms": {
        "deepep": 13.0, "all_to_all": 12.0, "all_gather": 9.0}})
    choice = choose_dispatcher(cfg("auto", slower, overlap="chunks"), SHAPE, None, None)
    assert choice.backend == "all_to_all" and choice.reason.startswith("auto: all_to_all, the fastest this run can use in")


def test_an_entry_whose_best_has_no_time_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"best = 'all_gather' has no time in layer_ms \(deepep, all_to_all\)"):
        choose_dispatcher(cfg("auto", write_tuned(tmp_path, entry(best="all_gather"))), SHAPE, None, 132)


def test_auto_keeps_all_to_all_where_deepep_cannot_run(tmp_path, no_deep_ep):
    path = write_tuned(tmp_path, entry())
    choice = choose_dispatcher(cfg("auto", path), SHAPE, None, 132)
    assert choice.backend == "all_to_all" and "; not deepep: the deep_ep package cannot be imported" in choice.reason
    choice = choose_dispatcher(cfg("auto", path, precision="float32"), SHAPE, None, 132)
    assert choice.backend == "all_to_all" and "; not deepep: needs [training] mixed_precision_param" in choice.reason


def test_explicit_backends_are_taken_as_asked(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert choose_dispatcher(cfg("all_to_all", str(broken)), SHAPE, None, 132).backend == "all_to_all"
    assert choose_dispatcher(cfg("local", str(broken)), tuned.Shape("cpu", 1, 8, 2, 8, 8), None, None).backend == "local"
    with pytest.raises(ConfigError, match="cannot read it as JSON"):
        choose_dispatcher(cfg("auto", str(broken)), SHAPE, None, 132)

"""The registry of dispatchers (dispatch/registry.py) and the dispatchers' shared machinery.

The registry: each entry's refusals against the rules stated here apart from it, and the config check,
the machine check, the choice and the build agreeing with its problem(); the shared autograd wrapper.
"""

import dataclasses
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from test_deepep import load_fake_deep_ep
from torchtitan_moe.config.sections import DISPATCH_KEYS, ConfigError, check_dispatch
from torchtitan_moe.dispatch import deepep_backend, registry
from torchtitan_moe.dispatch.backward import with_backward
from torchtitan_moe.dispatch.registry import OVERLAPS, Run
from torchtitan_moe.dispatch.seam import BUFFERS


# -- the registry's rules ------------------------------------------------------------------------------

# What each dispatcher takes, stated apart from the registry: EP sizes (of 1..16), overlaps, the
# parameters' dtypes (None: any), whether its EP group must sit inside one node.
TAKES = {
    "local": ({1}, {"none"}, None, False),
    "all_to_all": (set(range(2, 17)), set(OVERLAPS), None, False),
    "deepep": ({2, 4, 8}, set(OVERLAPS), {"bfloat16"}, True),
    "all_gather": ({2}, {"none"}, None, False),
}
RUNS = [Run(ep, overlap, buffers, dtype, procs)
        for ep in range(1, 17) for overlap in OVERLAPS for buffers in BUFFERS for dtype in ("bfloat16", "float32")
        for procs in (None, 2, 6, 8)]


def takes(name: str, run: Run) -> bool:
    eps, overlaps, dtypes, one_node = TAKES[name]
    return (run.ep in eps and run.overlap in overlaps and (dtypes is None or run.param_dtype in dtypes)
            and not (one_node and run.procs_per_node is not None and run.procs_per_node % run.ep))


def test_every_dispatcher_is_stated_here():
    assert set(registry.NAMES) == set(TAKES)


@pytest.mark.parametrize("name", registry.NAMES)
def test_problem_refuses_exactly_the_runs_a_dispatcher_does_not_take(name):
    entry = registry.get(name)
    marked = {key: f"<{key}>" for key in registry.PLAIN}
    for run in RUNS:
        problem = entry.problem(run, marked)
        assert (problem is None) == takes(name, run), f"{name}, {run}: {problem}"
        if problem is not None:  # one phrase, naming the refused fact in the words it was given
            assert "\n" not in problem and any(mark in problem for mark in marked.values()), problem


def config(backend: str, run: Run) -> SimpleNamespace:
    return SimpleNamespace(dispatch=SimpleNamespace(backend=backend, overlap=run.overlap, buffers=run.buffers, num_sms=0,
                                                    tuned_file=""),
                           training=SimpleNamespace(mixed_precision_param=run.param_dtype),
                           model=SimpleNamespace(name="qwen3_moe"), kernels=SimpleNamespace(backend="torch"),
                           parallelism=SimpleNamespace(expert_parallel_degree=run.ep))


@pytest.mark.parametrize("name", registry.NAMES)
def test_the_config_check_the_machine_check_and_the_build_agree_with_the_registry(name, monkeypatch):
    from torchtitan_moe.train.machine import check_machine

    entry = registry.get(name)
    monkeypatch.setitem(registry.DISPATCHERS, name, dataclasses.replace(entry, missing=None))  # a library is not asked
    for run in RUNS:
        problem = entry.problem(dataclasses.replace(run, procs_per_node=None), DISPATCH_KEYS)
        cfg = config(name, run)
        refused = problem is not None or (run.overlap != "none" and run.ep == 1)  # chunks need EP > 1, whatever the dispatcher
        try:
            check_dispatch(cfg, run.ep)
            assert not refused, f"{name}, {run}: the config check took it; the registry: {problem}"
        except ConfigError as e:
            assert refused, f"{name}, {run}: the config check refused it ({e}); the registry takes it"
            if problem is not None:
                assert str(e).startswith(f"[dispatch] backend = {name!r} {problem}"), str(e)
            continue
        # The machine check knows the processes per node.
        node_problem = entry.problem(run, DISPATCH_KEYS)
        try:
            check_machine(cfg, run.procs_per_node)
            assert node_problem is None, f"{name}, {run}: the machine check took it; the registry: {node_problem}"
        except ConfigError as e:
            assert node_problem is not None and str(e).startswith(f"[dispatch] backend = {name!r} {node_problem}"), str(e)
    for run in RUNS:  # the build refuses before it makes anything (no group needed to refuse)
        if entry.problem(run) is not None:
            with pytest.raises(ValueError, match=rf"^{name} dispatcher: needs "):
                entry.builder(run, None, torch.device("cpu"))


@pytest.mark.parametrize("overlap, precision", [("none", "bfloat16"), ("chunks", "bfloat16"), ("none", "float32")])
@pytest.mark.parametrize("ep", [2, 4])
def test_auto_picks_the_fastest_dispatcher_the_registry_lets_this_run_use(tmp_path, monkeypatch, ep, overlap, precision):
    from torchtitan_moe.parallel import tuned
    from torchtitan_moe.parallel.choose import choose_dispatcher

    monkeypatch.setitem(sys.modules, "deep_ep", load_fake_deep_ep())
    monkeypatch.setattr(deepep_backend, "check_group", lambda group: None)  # one host, peers reachable
    shape = tuned.Shape("NVIDIA H200", ep, 2048, 8, 128, 8192)
    cfg = config("auto", Run(ep, overlap, "exact", precision))
    run = Run(ep, overlap, "exact", precision)
    ms = {name: 10.0 + i for i, name in enumerate(reversed(registry.NAMES))}  # the last entry the fastest
    for best in registry.NAMES:
        path = tmp_path / f"{best}.json"
        raw = {**dataclasses.asdict(shape), "best": best, "layer_ms": ms,
               "deepep": {"num_sms": 64, "dispatch_chunk": 16, "combine_chunk": 8, "buffer_tokens": 256}}
        path.write_text(json.dumps({"version": 1, "entries": [raw]}))
        cfg.dispatch.tuned_file = str(path)
        choice = choose_dispatcher(cfg, shape, None, None)
        expected = best if registry.get(best).problem(run) is None else next(
            n for n in sorted(ms, key=ms.get) if registry.get(n).problem(run) is None)
        assert choice.backend == expected, (best, choice.reason)
        assert (choice.settings is not None) == registry.get(expected).tuned


# -- the shared machinery -----------------------------------------------------------------------------


def test_with_backward_sends_zeros_for_a_result_without_gradient():
    # The reverse exchange is a collective: a result that got no gradient still sends one (zeros), and the
    # backward learns which inputs need theirs.
    x, p = torch.randn(3, 2, requires_grad=True), torch.randn(3)
    seen = []

    def back(grads, needs):
        seen.append(([None if g is None else g.clone() for g in grads], needs))
        return grads[0][:3] * 2, grads[1][:3]

    a, b = with_backward([torch.randn(4, 2), torch.randn(4)], (x, p), back)
    assert a.requires_grad and b.requires_grad
    weight = torch.randn(4, 2)
    (a * weight).sum().backward()  # b gets no gradient
    (grads, needs), = seen
    assert needs == (True, False)
    assert torch.equal(grads[0], weight)
    assert grads[1] is not None and grads[1].shape == (4,) and not grads[1].any()
    assert torch.equal(x.grad, 2 * weight[:3])

"""Serving from two processes (model/multihost.py): two subprocesses joined by
`jax.distributed.initialize` on the CPU (gloo collectives), two devices each, the model split
tp=4 over all four. Process 0 generates through a `LeaderRunner`; process 1 runs `follow`.
Both must run the same plans (with the seeds the leader drew) and see the same tokens, which
must equal one process without tensor parallelism; and the follower must stop when the
leader closes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from model.config import EngineConfig
from model.loader import load_model
from model.multihost import with_seeds
from model.offline import generate
from model.step_types import SamplingParams, SlotSetup, StepPlan
from tests.conftest import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = [[1, 5, 9, 200, 300], [1, 77, 78, 79, 80, 81], [1] + list(range(400, 430))]


def engine_config(tp: int) -> EngineConfig:
    return EngineConfig(num_slots=4, max_context=64, prefill_budget=16, prefill_chunks=(16,), context_buckets=(64,),
                        max_top_logprobs=4, tensor_parallel=tp)


WORKER = r'''
import json, logging, re, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
path, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
from model.loader import load_model
from model.multihost import LeaderRunner, follow
from model.offline import generate
from model.step_types import SamplingParams
from tests.model.test_multihost import PROMPTS, engine_config

cfg = engine_config(4)
runner = load_model(path, cfg).make_runner(cfg)

def seeds(plan):
    return [s.sampling.seed for s in plan.setups]


if pid == 0:
    ran = []  # the plans the leader's own runner ran (seeds filled in)

    class Recording:
        def __init__(self, inner):
            self.inner = inner
            for name in ("num_slots", "max_context", "prefill_chunks", "max_top_logprobs", "decode_steps", "vocab_size"):
                setattr(self, name, getattr(inner, name))

        def warmup(self):
            self.inner.warmup()

        def dispatch(self, plan):
            ran.append(seeds(plan))
            return self.inner.dispatch(plan)

    leader = LeaderRunner(Recording(runner))
    leader.warmup()
    compiles = []  # the functions JAX compiles while serving, from its compile log

    class Compiles(logging.Handler):
        def emit(self, record):
            m = re.match(r"Compiling (\S+)", record.getMessage())
            if m:
                compiles.append(m.group(1))

    logging.getLogger("jax").addHandler(Compiles())
    jax.config.update("jax_log_compiles", True)
    greedy = generate(leader, PROMPTS, 8)
    seeded = generate(leader, PROMPTS, 8, sampling=SamplingParams(temperature=0.9, top_p=0.95))  # seeds left open
    jax.config.update("jax_log_compiles", False)
    leader.close()
    print(json.dumps({"greedy": greedy, "seeded": seeded, "devices": jax.device_count(), "seeds": ran,
                      "compiles": compiles}))
else:
    seen, got = [], []

    def on_step(plan, outs):
        got.append(seeds(plan))
        seen.append([[int(t) if v else None for t, v in zip(o.tokens, o.valid)] for o in outs])

    steps = follow(runner, on_step=on_step)
    print(json.dumps({"steps": steps, "outputs": seen, "seeds": got}))
'''


@pytest.fixture(scope="module")
def two_processes(tiny_tp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """Runs both workers; if one fails (or they hang), both are stopped and both logs shown."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    port = str(free_port())
    logs = tmp_path_factory.mktemp("workers")
    outs = [logs / f"worker{pid}.out" for pid in (0, 1)]
    errs = [logs / f"worker{pid}.err" for pid in (0, 1)]
    procs = []
    for pid in (0, 1):
        with open(outs[pid], "w") as out, open(errs[pid], "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(tiny_tp_path), port, str(pid)], cwd=ROOT,
                                          env=env, stdout=out, stderr=err))

    def tails() -> str:
        return "\n".join(f"--- worker {pid} (exit {procs[pid].poll()}):\n{errs[pid].read_text()[-3000:]}" for pid in (0, 1))

    deadline = time.monotonic() + 300
    try:
        while any(proc.poll() is None for proc in procs):
            if any(proc.poll() not in (None, 0) for proc in procs):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the workers did not finish in 300 s\n{tails()}")
            time.sleep(0.2)
        if any(proc.poll() != 0 for proc in procs):
            for proc in procs:
                proc.kill()
                proc.wait()
            pytest.fail(f"a worker failed\n{tails()}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    leader, follower = (json.loads(o.read_text().strip().splitlines()[-1]) for o in outs)
    return leader, follower


def test_leader_tokens_equal_one_process_without_tensor_parallelism(two_processes, tiny_tp_path):
    leader, _ = two_processes
    assert leader["devices"] == 4
    cfg = engine_config(1)
    runner = load_model(tiny_tp_path, cfg).make_runner(cfg)
    runner.warmup()
    assert leader["greedy"] == generate(runner, PROMPTS, 8)


def test_follower_ran_every_plan_with_the_same_outputs(two_processes):
    leader, follower = two_processes
    # generate(): one prefill step, then one decode step per further token, per call
    assert follower["steps"] == 2 * 8
    # the follower's sampled tokens, step by step, are the leader's
    per_step = [step[0] for step in follower["outputs"]]
    for run, first in ((leader["greedy"], 0), (leader["seeded"], 8)):
        for i in range(8):
            tokens = per_step[first + i]
            assert [tokens[slot] for slot in range(len(PROMPTS))] == [run[slot][i] for slot in range(len(PROMPTS))]


def test_with_seeds_draws_only_missing_seeds():
    rng = np.random.default_rng(0)
    plan = StepPlan(setups=(SlotSetup(0, SamplingParams(seed=5)), SlotSetup(1, SamplingParams())))
    out = with_seeds(plan, rng)
    assert out.setups[0].sampling.seed == 5 and out.setups[1].sampling.seed is not None
    assert with_seeds(out, rng) is out


def test_follower_gets_the_seeds_the_leader_drew(two_processes):
    """Seeds a request leaves open are drawn once, by the leader, and sent with the plan: every
    process must feed the SPMD programs the same host inputs. (The tokens alone would not show
    it: on the CPU the replicated outputs followed process 0's inputs even with other seeds.)"""
    leader, follower = two_processes
    assert follower["seeds"] == leader["seeds"]
    drawn = [s for step in leader["seeds"] for s in step]
    assert len(drawn) == 2 * len(PROMPTS) and all(s is not None for s in drawn)


def test_nothing_compiles_while_the_leader_serves(two_processes):
    """The runner's programs and the plan broadcasts (`_psum`) are compiled in warmup. One tiny
    exception, JAX's own: the first decode compiles `jit(stage)`, which places the host's
    active-slot mask on the multi-process mesh (17 ms on this CPU)."""
    leader, _ = two_processes
    assert set(leader["compiles"]) <= {"jit(stage)"}, leader["compiles"]


def test_a_follower_runs_after_warmup_between_its_compiles_and_the_first_plan(monkeypatch):
    """`follow(after_warmup=...)` (the engine's heap freeze on processes other than 0): after the
    runner's warm-up and the broadcasts', before the first plan is read."""
    import pickle

    from model import multihost

    calls = []

    class Runner:
        num_slots, vocab_size = 8, 32000

        def warmup(self):
            calls.append("warmup")

    monkeypatch.setattr(multihost, "warm_broadcasts", lambda size: calls.append("warm_broadcasts"))
    monkeypatch.setattr(multihost, "broadcast_bytes", lambda payload: calls.append("plan") or pickle.dumps(None))
    assert multihost.follow(Runner(), after_warmup=lambda: calls.append("after_warmup")) == 0
    assert calls == ["warmup", "warm_broadcasts", "after_warmup", "plan"]


@pytest.mark.parametrize("gc_freeze", [True, False])
def test_run_follower_freezes_the_heap_while_it_follows(monkeypatch, gc_freeze):
    import gc

    from model import multihost
    from scheduler import loader

    class Loaded:
        def make_runner(self, config):
            return "runner"

    frozen_while_following = []

    def follow(runner, after_warmup=None):
        if after_warmup is not None:
            after_warmup()
        frozen_while_following.append(gc.get_freeze_count())
        return 3

    gc.unfreeze()
    config = EngineConfig(gc_freeze=gc_freeze)
    monkeypatch.setattr(loader, "load_resolved", lambda path, cfg: (Loaded(), cfg))
    monkeypatch.setattr(multihost, "follow", follow)
    assert loader.run_follower("model.gguf", config) == 3
    assert (frozen_while_following[0] > 1000) == gc_freeze and gc.get_freeze_count() == 0

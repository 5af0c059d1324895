"""N ranks == 1 rank, on CPU with gloo: one LLM(...) starting 2 or 4 rank processes.

For the built-in tiny checkpoint at (D, E, G) in {(2,2,1), (1,2,1), (2,2,2), (4,4,2)} the
greedy and the seeded sampled tokens equal the single-rank engine's; in batch-invariant mode
the logprobs (a function of the logits) are bitwise equal, also with redundant expert slots and
EPLB rebalancing in the middle of generation. Interrupting a generate leaves the ranks ready for
the next; a killed rank makes generate raise naming it and leaves no process behind; bad
layouts fail before anything loads. Under torchrun every rank returns every output.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from deepinfer_engine.llm import LLM
from deepinfer_parallel.layout import LayoutError
from deepinfer_parallel.local_ranks import RankFailure
from deepinfer_sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["Hello there", "The cat sat on the", "Once upon a time", "1 2 3 4", "A"]
GREEDY = SamplingParams(max_tokens=6, temperature=0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seq_seed=11, n=2)
LOGPROBS = SamplingParams(max_tokens=4, temperature=0.8, seq_seed=3, logprobs=4, prompt_logprobs=2)
ENGINE = dict(kv_cache_bytes=8 << 20, max_num_seqs=8, collective_timeout_s=60)


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _values(steps):
    return [None if s is None else {t: lp.logprob for t, lp in s.items()} for s in steps]


def logprobs(outputs):
    return [
        (_values(o.prompt_logprobs), [(c.token_ids, _values(c.logprobs)) for c in o.outputs])
        for o in outputs
    ]


@pytest.fixture(scope="module")
def one_rank():
    llm = LLM(**ENGINE)
    want = {
        "greedy": tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
        "seeded": tokens(llm.generate(PROMPTS, SEEDED, use_tqdm=False)),
    }
    bi = LLM(**ENGINE, batch_invariant=True)
    want["bitwise"] = logprobs(bi.generate(PROMPTS, LOGPROBS, use_tqdm=False))
    return want


@pytest.mark.parametrize("sizes", [(2, 2, 1), (1, 2, 1), (2, 2, 2), (4, 4, 2)], ids=str)
def test_ranks_give_the_tokens_of_one_rank(sizes, one_rank):
    d, e, g = sizes
    llm = LLM(**ENGINE, data_parallel_size=d, expert_parallel_size=e, engram_parallel_size=g)
    try:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == one_rank["greedy"]
        assert tokens(llm.generate(PROMPTS, SEEDED, use_tqdm=False)) == one_rank["seeded"]
        done = llm.engine.last_run
        assert len(done) == max(sizes) and len({m.times.steps for m in done}) == 1
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dispatch", ["allgather", "alltoall"])
def test_batch_invariant_logits_are_bitwise_through_rebalances(dispatch, one_rank):
    # 2 redundant expert slots, experts rearranged every 2 steps while requests run
    llm = LLM(
        **ENGINE,
        batch_invariant=True,
        data_parallel_size=2,
        expert_parallel_size=2,
        engram_parallel_size=2,
        num_extra_experts=2,
        expert_rearrangement_step_interval=2,
        expert_count_window_size=4,
        expert_dispatch=dispatch,
    )
    try:
        assert logprobs(llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)) == one_rank["bitwise"]
        assert all(m.times.rebalances >= 2 for m in llm.engine.last_run)
    finally:
        llm.shutdown()


def _listening_addresses(pids) -> set[str]:
    """Local addresses of the TCP sockets these processes listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    found.add(cols[1].split(":")[0])
    return found


LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/status") as f:  # a zombie is gone too (not yet reaped)
        return "zombie" in f.read()


def test_interrupt_then_a_killed_rank(one_rank):
    llm = LLM(**ENGINE, data_parallel_size=2, expert_parallel_size=2)
    pids = llm.engine.pids
    # nothing reachable from outside: every listening socket of the driver and the ranks is
    # on the loopback interface
    listening = _listening_addresses([os.getpid(), *pids])
    assert listening and listening <= LOOPBACK_HEX, listening
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    # Ctrl-C in the middle of a run (SIGINT to the main thread, as a terminal sends it): every
    # rank stops at its next step, and the next call is clean
    main = threading.main_thread().ident
    threading.Timer(1.5, signal.pthread_kill, (main, signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, long, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == one_rank["greedy"]
    # a rank killed mid-run: generate names it, and no rank process is left
    threading.Timer(1.5, os.kill, (pids[1], signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
        llm.generate(PROMPTS, long, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="rank processes are gone"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_bad_layouts_fail_before_loading():
    t0 = time.monotonic()
    with pytest.raises(LayoutError, match=r"data=2, expert=3, engram=1 need 3 ranks"):
        LLM(data_parallel_size=2, expert_parallel_size=3)
    # the built-in model has 8 experts: 8 + 2 slots do not split over 4 ranks
    with pytest.raises(LayoutError, match=r"8 routed experts \+ 2 redundant slots = 10"):
        LLM(expert_parallel_size=4, num_extra_experts=2)
    with pytest.raises(ValueError, match="need expert_parallel_size > 1"):
        LLM(data_parallel_size=2, num_extra_experts=4)
    with pytest.raises(ValueError, match="expert_dispatch='nccl' is not allowed"):
        LLM(expert_parallel_size=2, expert_dispatch="nccl")
    assert time.monotonic() - t0 < 5  # nothing was loaded


def test_torchrun_ranks_each_return_every_output(one_rank, tmp_path):
    script = os.path.join(os.path.dirname(__file__), "torchrun_generate.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    args = [script, str(tmp_path), json.dumps([PROMPTS, GREEDY.max_tokens])]
    run = subprocess.run(cmd + args, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            assert json.load(f) == one_rank["greedy"]

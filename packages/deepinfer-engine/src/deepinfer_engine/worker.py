"""The body of one rank process of a single-node multi-rank `LLM` (`rank_main`).

Started by the driver's `LocalRanks` (the rank has joined the process group by then): build
this rank's `RankEngine`, report `RankReady`, then serve the driver's messages until
`Shutdown`: each `Generate` runs the ranks' step loop (polling the pipe for an `Abort` before
every step), streams `RankOutputs` from DP leaders and ends with `RankDone`. An exception ends
the process; `LocalRanks` reports it to the driver with this rank's traceback.
"""

from __future__ import annotations

import json

from deepinfer_parallel.local_ranks import RankConn

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.rank_engine import RankEngine
from deepinfer_engine.step_messages import (
    Abort,
    Generate,
    MessageError,
    RankDone,
    RankOutputs,
    Shutdown,
    decode,
    encode,
)


def rank_main(rank: int, conn: RankConn, config_json: str) -> None:
    """`config_json`: the driver's resolved `EngineConfig` fields (the rank reads no
    environment of its own); rank r uses device r of its node."""
    config = EngineConfig(**json.loads(config_json))
    engine = RankEngine(config, device_index=rank)
    conn.send(encode(engine.ready()))
    while True:
        msg = decode(conn.recv())
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, Abort):
            continue  # it arrived after its run ended: nothing is running
        if not isinstance(msg, Generate):
            raise MessageError(f"rank {rank}: unexpected {type(msg).__name__} between runs")
        aborted = False

        def should_abort() -> bool:
            nonlocal aborted
            while not aborted and conn.poll(0):
                m = decode(conn.recv())
                if not isinstance(m, Abort):
                    raise MessageError(f"rank {rank}: unexpected {type(m).__name__} in a run")
                aborted = True
            return aborted

        for outputs in engine.run(msg.requests, should_abort):
            if engine.is_dp_leader:
                conn.send(encode(RankOutputs(outputs)))
        conn.send(encode(RankDone(rank, engine.load(), engine.times())))

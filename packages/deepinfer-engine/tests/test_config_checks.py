"""Engine settings checked against the model and against each other: the draft length against
the model's DSpark stages, keep tokens without truncation, and errors that name where a value
came from (argument or environment variable)."""

from __future__ import annotations

import logging

import pytest
import torch
from deepinfer_engine.config import EngineConfig
from deepinfer_engine.llm import LLM
from toy import ToyModel

KEEP = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"


def make(model=None, env=None, **kw):
    if env is not None:
        kw["env"] = env
    return LLM.from_model(model or ToyModel(), accelerator="cpu", dtype="float32", **kw)


@pytest.mark.parametrize(
    ("drafts", "given", "origin"),
    [
        (5, {"use_nextn_decode": 6}, "the use_nextn_decode argument"),
        (5, {"env": {"DEEPINFER_USE_NEXTN_DECODE": "7"}}, "DEEPINFER_USE_NEXTN_DECODE"),
        (0, {"use_nextn_decode": 1}, "the use_nextn_decode argument"),
    ],
)
def test_draft_length_above_what_the_dspark_stages_draft_is_refused(drafts, given, origin):
    allowed = f"0..{drafts}" if drafts else "0 .the model has no DSpark stages."
    with pytest.raises(ValueError, match=rf"use_nextn_decode=\d \({origin}\).*allowed: {allowed}"):
        make(ToyModel(drafts=drafts), **given)


def test_draft_length_defaults_to_what_the_model_drafts():
    assert make(ToyModel(drafts=3)).engine.config.use_nextn_decode == 3
    assert make(ToyModel(drafts=0)).engine.config.use_nextn_decode == 0
    assert make(ToyModel(drafts=3), use_nextn_decode=2).engine.config.use_nextn_decode == 2
    assert EngineConfig.from_env({}).use_nextn_decode is None  # resolved by the engine


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        (
            {"env": {"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "200"}},
            "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
        ),
        ({"yoco_prefill_keep_tokens": 200}, "the yoco_prefill_keep_tokens argument"),
    ],
)
def test_keep_tokens_without_truncation_warns(caplog, kw, name):
    env = kw.pop("env", {})
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        EngineConfig.from_env(env, **kw)
    assert any(
        name in r.getMessage() and "yoco_prefill_truncation_mode is 'off'" in r.getMessage()
        for r in caplog.records
    ), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        EngineConfig.from_env(env, yoco_prefill_truncation_mode="mask", **kw)
        EngineConfig.from_env({})
    assert not caplog.records


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("env", "kw", "origin"),
    [
        ({}, {"accelerator": "nvidia"}, "the accelerator argument"),
        ({"DEEPINFER_ACCELERATOR": "nvidia"}, {}, "DEEPINFER_ACCELERATOR"),
    ],
)
def test_accelerator_errors_name_where_the_value_came_from(env, kw, origin):
    cfg = EngineConfig.from_env(env, **kw)
    with pytest.raises(ValueError, match=rf"accelerator='nvidia' \({origin}\).*CUDA"):
        cfg.device()
    with pytest.raises(ValueError, match=rf"\({origin}\)"):
        LLM.from_model(ToyModel(), env=env, **kw)

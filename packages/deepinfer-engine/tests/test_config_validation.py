"""EngineConfig (env vs arguments) and request validation."""

from __future__ import annotations

import pytest
from deepinfer_engine.config import EngineConfig
from deepinfer_engine.validation import validate_requests
from deepinfer_sampling.params import SamplingParams


def test_env_is_read_and_argument_wins():
    env = {
        "DEEPINFER_ASYNC_SCHEDULING": "0",
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact",
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "200",
        "DEEPINFER_USE_NEXTN_DECODE": "3",
        "DEEPINFER_BATCH_INVARIANT": "true",
        "DEEPINFER_ACCELERATOR": "cpu",
        "DEEPINFER_HF_MODEL_DIR": "/models/v41",
    }
    cfg = EngineConfig.from_env(env)
    assert (cfg.async_scheduling, cfg.yoco_prefill_truncation_mode) == (False, "compact")
    assert (cfg.yoco_prefill_keep_tokens, cfg.use_nextn_decode) == (200, 3)
    assert (cfg.batch_invariant, cfg.accelerator, cfg.model) == (True, "cpu", "/models/v41")
    cfg = EngineConfig.from_env(env, async_scheduling=True, model="/other")
    assert cfg.async_scheduling is True and cfg.model == "/other"
    assert EngineConfig.from_env({}).async_scheduling is True


@pytest.mark.parametrize(
    ("var", "value", "match"),
    [
        ("DEEPINFER_ASYNC_SCHEDULING", "maybe", "ASYNC_SCHEDULING='maybe' is not a boolean"),
        ("DEEPINFER_ACCELERATOR", "tpu", "DEEPINFER_ACCELERATOR='tpu'.*nvidia, ascend, cpu"),
        ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "on", "off, mask, compact"),
        ("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "-3", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"),
        ("DEEPINFER_USE_NEXTN_DECODE", "x", "DEEPINFER_USE_NEXTN_DECODE"),
    ],
)
def test_bad_env_value_names_the_variable(var, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_env({var: value})


def test_bad_argument_names_the_argument():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.from_env({}, max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown engine argument"):
        EngineConfig.from_env({}, max_num_sequences=3)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig.from_env({}, enforce_eager="sometimes")
    assert EngineConfig.from_env({}, enforce_eager="1").enforce_eager is True


@pytest.mark.parametrize("raw", ["1", "On", "no", "FALSE", " yes ", "maybe", "2"])
def test_batch_invariant_env_reads_as_the_kernels_read_it(raw):
    """The engine and the kernel registry parse DEEPINFER_BATCH_INVARIANT with one function."""
    from deepinfer_kernels.settings import parse_bool

    env = {"DEEPINFER_BATCH_INVARIANT": raw}
    try:
        want = parse_bool("DEEPINFER_BATCH_INVARIANT", raw)
    except ValueError:
        with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT"):
            EngineConfig.from_env(env)
        return
    assert EngineConfig.from_env(env).batch_invariant is want


def encode(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        (["ok", ""], "prompt 1: empty prompt"),
        (["ok", [1, 2], []], "prompt 2: empty prompt"),
        ([[1, 2], "x" * 40], "prompt 1: prompt has 40 tokens"),
        ([[1, 100]], "prompt 0: token id 100 is outside the vocabulary"),
        ([{"prompt_token_ids": [1, -1]}], "prompt 0: token id -1"),
        (["a", 3.5], "prompt 1: must be a string"),
    ],
)
def test_bad_prompts_name_their_index(prompts, match):
    with pytest.raises(ValueError, match=match):
        validate_requests(prompts, None, encode, vocab_size=100, max_model_len=32)


def test_bad_params_name_their_index():
    sp = SamplingParams()
    object.__setattr__(sp, "n", 0)  # bypass the frozen dataclass: generate re-checks
    with pytest.raises(ValueError, match="prompt 1: invalid SamplingParams: n must be"):
        validate_requests(["a", "b"], [SamplingParams(), sp], encode, 100, 32)
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        validate_requests(["a", "b", "c"], [sp, sp], encode, 100, 32)
    with pytest.raises(ValueError, match="prompt 0: stop_token_ids has 500"):
        validate_requests(["a"], SamplingParams(stop_token_ids=[500]), encode, 100, 32)


def test_prompt_forms():
    reqs = validate_requests(["ab", [3, 4], {"prompt_token_ids": [5]}], None, encode, 100, 32)
    assert [(r.prompt, r.prompt_token_ids) for r in reqs] == [
        ("ab", [97, 98]),
        (None, [3, 4]),
        (None, [5]),
    ]
    assert [r.prompt_token_ids for r in validate_requests([7, 8], None, encode, 100, 32)] == [
        [7, 8]
    ]


def test_gpu_memory_utilization_is_parsed_to_a_float():
    assert EngineConfig.from_env({}, gpu_memory_utilization="0.5").gpu_memory_utilization == 0.5
    for bad in ("lots", True, float("nan"), 0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig.from_env({}, gpu_memory_utilization=bad)


@pytest.mark.parametrize("ids", [["1", "2"], [1.0, 2], [True, 3], [1, None]])
def test_token_ids_must_be_integers(ids):
    with pytest.raises(ValueError, match="prompt 0: prompt_token_ids must be a list of ints"):
        validate_requests([ids], None, encode, 100, 32)


def test_numpy_token_ids_are_accepted():
    np = pytest.importorskip("numpy")
    reqs = validate_requests([list(np.array([3, 4]))], None, encode, 100, 32)
    assert reqs[0].prompt_token_ids == [3, 4] and type(reqs[0].prompt_token_ids[0]) is int


@pytest.mark.parametrize("model", ["", "  ", 123])
def test_bad_model_argument_names_it(model):
    with pytest.raises(ValueError, match="model="):
        EngineConfig.from_env({}, model=model)


def test_sampling_params_of_the_wrong_type_are_named():
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list"):
        validate_requests(["a"], {"temperature": 0}, encode, 100, 32)


def test_parallel_and_eplb_settings_from_env_and_arguments():
    env = {
        "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "50",
        "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "300",
        "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "8",
        "DEEPINFER_GLOO_TIMEOUT": "90",
    }
    cfg = EngineConfig.from_env(env, data_parallel_size=8, expert_parallel_size=8)
    assert (cfg.expert_count_window_size, cfg.expert_rearrangement_step_interval) == (50, 300)
    assert (cfg.num_extra_experts, cfg.collective_timeout_s) == (8, 90.0)
    assert cfg.layout.world_size == 8 and cfg.launched is None
    launcher = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}
    launcher |= {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    cfg = EngineConfig.from_env(launcher, expert_parallel_size=8)
    assert (cfg.launched.rank, cfg.launched.world_size, cfg.launched.local_rank) == (3, 8, 3)
    with pytest.raises(ValueError, match=r"started 8 ranks \(WORLD_SIZE\).*need 2"):
        EngineConfig.from_env(launcher, expert_parallel_size=2)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "0"}, "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE='0'"),
        ({"DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "x"}, "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"),
        ({"DEEPINFER_GLOO_TIMEOUT": "-1"}, "DEEPINFER_GLOO_TIMEOUT='-1'"),
        (
            {
                "RANK": "4",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
            },
            "RANK=4 must be < WORLD_SIZE=4",
        ),
    ],
)
def test_bad_parallel_env_values_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_env(env, expert_parallel_size=4)

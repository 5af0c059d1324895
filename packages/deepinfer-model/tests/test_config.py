"""ModelConfig: HF names, reference aliases, validation naming the field, tiny()."""

import pytest
from deepinfer_model.config import ModelConfig, engram_primes


def test_released_defaults_validate_and_engram_primes_sum_to_rows():
    cfg = ModelConfig()
    cfg.validate()
    primes = cfg.engram_layout_primes()
    assert [sum(sum(r) for r in layer) for layer in primes] == list(cfg.engram_num_embeddings)
    flat = [p for layer in primes for row in layer for p in row]
    assert len(flat) == len(set(flat)) == 2 * 3 * 8
    assert min(flat) > 16_000_000
    assert cfg.decoder_start_layer == 20
    assert (
        cfg.kv_source_of(25) == 20 and cfg.index_source_of(25) == 24 and cfg.kv_source_of(13) == 8
    )


def test_from_hf_composite_with_aliases_and_rope_scaling():
    raw = {
        "model_type": "deepseek_v41",
        "eos_token_id": 1,
        "quantization_config": {"weight_block_size": [32, 32], "scale_fmt": "ue8m0"},
        "vision_config": {"hidden_size": 1024},
        "text_config": {
            "dim": 5120,
            "window_size": 128,
            "kv_source_layers": [2, 8, 14, 20],
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            "some_unknown_key": 3,
        },
    }
    cfg = ModelConfig.from_hf(raw)
    assert cfg.hidden_size == 5120 and cfg.sliding_window == 128 and cfg.rope_factor == 16
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20)
    assert cfg.extra["some_unknown_key"] == 3


def test_tiny_roundtrips_through_hf_dict():
    tiny = ModelConfig.tiny()
    assert ModelConfig.from_hf(tiny.to_hf()) == tiny
    assert tiny.compress_ratios[: tiny.num_hidden_layers] == (0, 0, 2, 2, 1, 1, 1, 1)
    assert tiny.engram_num_embeddings == tuple(
        sum(sum(r) for r in layer) for layer in engram_primes((1, 3), 4, 2, 101)
    )


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"compress_ratios": (0, 0, 2)}, "compress_ratios"),
        ({"kv_source_layer_ids": (3, 4)}, "kv_source_layer_ids"),
        (
            {
                "kv_source_layer_ids": (2,),
                "index_source_layer_ids": (2,),
                "candidate_source_layer_id": -1,
            },
            "compress_ratios",
        ),
        ({"index_source_layer_ids": (4, 6)}, "kv_source_layer_ids"),
        ({"candidate_source_layer_id": 5}, "candidate_source_layer_id"),
        ({"hidden_size": 72}, "hidden_size"),
        ({"engram_layer_ids": (1, 9)}, "engram_layer_ids"),
        ({"engram_num_embeddings": (10, 10)}, "engram_num_embeddings"),
        ({"dspark_target_layer_ids": (8,)}, "dspark_target_layer_ids"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"index_topk": 16}, "index_topk"),
        ({"index_source_layer_ids": (1, 2, 4, 6)}, "index_source_layer_ids"),
        ({"fp8_block_size": 128}, "fp8_block_size"),
        ({"rope_theta": "1e4"}, "rope_theta"),
        ({"compress_rope_theta": 0.0}, "compress_rope_theta"),
        ({"rope_factor": -1.0}, "rope_factor"),
        ({"hc_eps": "tiny"}, "hc_eps"),
        ({"gate_temp": None}, "gate_temp"),
        ({"swiglu_limit": float("nan")}, "swiglu_limit"),
    ],
)
def test_validation_names_the_field(override, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ModelConfig.tiny(**override)


def _hf_text(**text):
    """A composite HF config.json dict holding the tiny text config plus `text` overrides."""
    raw = ModelConfig.tiny().to_hf()
    raw["text_config"].update(text)
    return raw


def test_backbone_only_compress_ratios_get_zero_dspark_entries():
    # HF DeepseekV41TextConfig: `compress_ratios` has num_hidden_layers entries, optionally
    # followed by the (always 0) DSpark entries; missing DSpark entries are 0
    tiny = ModelConfig.tiny()
    n = tiny.num_hidden_layers
    cfg = ModelConfig.from_hf(_hf_text(compress_ratios=list(tiny.compress_ratios[:n])))
    assert cfg.compress_ratios == tiny.compress_ratios
    cfg = ModelConfig.from_hf(_hf_text(compress_ratios=list(tiny.compress_ratios[: n + 1])))
    assert cfg.compress_ratios == tiny.compress_ratios
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.from_hf(_hf_text(compress_ratios=list(tiny.compress_ratios[: n - 1])))
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.from_hf(_hf_text(compress_ratios=[*tiny.compress_ratios, 0]))


def test_null_candidate_source_means_last_kv_source_and_negative_disables():
    # HF: `candidate_source_layer_id` None defaults to the last kv source; < 0 disables
    assert (
        ModelConfig.from_hf(_hf_text(candidate_source_layer_id=None)).candidate_source_layer_id == 4
    )
    assert (
        ModelConfig.from_hf(_hf_text(candidate_source_layer_id=-1)).candidate_source_layer_id == -1
    )
    raw = _hf_text()
    del raw["text_config"]["candidate_source_layer_id"]  # absent = HF's default None
    assert ModelConfig.from_hf(raw).candidate_source_layer_id == 4


def test_null_special_token_ids_keep_the_defaults():
    raw = _hf_text(bos_token_id=None, pad_token_id=None)
    raw["bos_token_id"] = None
    raw["pad_token_id"] = None
    cfg = ModelConfig.from_hf(raw)
    assert cfg.bos_token_id == 0 and cfg.pad_token_id == 2


def test_rope_parameters_main_compress_form():
    # a config saved by transformers carries rope_parameters {main, compress} (YaRN on compress)
    raw = _hf_text(
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 20000.0},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 80000.0,
                "factor": 8,
                "original_max_position_embeddings": 4096,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        }
    )
    del raw["text_config"]["rope_scaling"]
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (20000.0, 80000.0)
    assert (cfg.rope_factor, cfg.original_max_position_embeddings) == (8, 4096)
    assert (cfg.beta_fast, cfg.beta_slow) == (16, 2)


def test_reference_zero_dspark_expert_counts_fall_back_to_the_backbone():
    # reference ModelArgs.get_moe_config: `dspark_n_routed_experts or n_routed_experts`, same for
    # the activated count
    cfg = ModelConfig.from_hf(_hf_text(dspark_n_routed_experts=0, dspark_n_activated_experts=0))
    assert (cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok) == (4, 2)


def test_engram_pad_id_uses_the_hugging_face_spelling():
    """transformers' DeepseekV41TextConfig names the field `engram_pad_id`; a config written
    with the project's own name would leave Hugging Face on its default (2)."""
    cfg = ModelConfig.tiny(engram_pad_token_id=5)
    text = cfg.to_hf()["text_config"]
    assert text["engram_pad_id"] == 5 and "engram_pad_token_id" not in text
    assert ModelConfig.from_hf(cfg.to_hf()).engram_pad_token_id == 5
    for name in ("engram_pad_id", "engram_pad_token_id"):
        raw = ModelConfig.tiny().to_hf()
        raw["text_config"].pop("engram_pad_id")
        raw["text_config"][name] = 7
        assert ModelConfig.from_hf(raw).engram_pad_token_id == 7
    raw = ModelConfig.tiny().to_hf()
    raw["text_config"].update(engram_pad_id=3, engram_pad_token_id=4)
    with pytest.raises(ValueError, match=r"engram_pad_id=3.*engram_pad_token_id=4"):
        ModelConfig.from_hf(raw)


def test_the_builtin_checkpoint_writes_the_hugging_face_spelling():
    import json

    from deepinfer_model.builtin import builtin_checkpoint

    raw = json.loads((builtin_checkpoint() / "config.json").read_text())
    text = raw["text_config"]
    assert "engram_pad_token_id" not in text
    assert ModelConfig.from_hf(raw).engram_pad_token_id == text["engram_pad_id"]

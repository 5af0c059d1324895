"""The engine-model seam: the toy and the V4.1 runtime both have the `EngineModel` shape."""

from __future__ import annotations

from deepinfer_engine.engine_model import EngineModel
from deepinfer_model.config import ModelConfig
from deepinfer_model.runtime import ModelRuntime
from toy import ToyModel


def test_the_toy_and_the_v41_runtime_are_engine_models():
    assert isinstance(ToyModel(), EngineModel)
    runtime = ModelRuntime(model=None, config=ModelConfig.tiny(), tokenizer=None)
    assert isinstance(runtime, EngineModel)
    assert runtime.supports_yoco_floor and runtime.has_dspark_stages
    assert not isinstance(object(), EngineModel)


def test_the_runtime_drafts_one_dspark_block_and_floors_only_before_consumers():
    tiny = ModelConfig.tiny()
    assert ModelRuntime(None, tiny, None).max_draft_tokens == tiny.dspark_block_size == 4
    no_stages = ModelConfig.tiny(
        num_nextn_predict_layers=0, compress_ratios=tiny.compress_ratios[:8]
    )
    assert ModelRuntime(None, no_stages, None).max_draft_tokens == 0
    assert ModelRuntime(None, ModelConfig(), None).max_draft_tokens == 5
    # a kv source after the decoder start (layer 4) would compress consumer rows
    late_source = ModelConfig.tiny(kv_source_layer_ids=(2, 4, 6), candidate_source_layer_id=-1)
    assert not ModelRuntime(None, late_source, None).supports_yoco_floor

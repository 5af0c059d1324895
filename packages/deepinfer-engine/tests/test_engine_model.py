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

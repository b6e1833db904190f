"""models-bert against the core's embedding model contract (pooled hidden states vs transformers)."""

from engine.testing.models import EmbeddingModelContract


class TestBertModels(EmbeddingModelContract):
    model_class = "engine_models_bert.model:BertModel"

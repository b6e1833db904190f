"""models-bert against the core's contracts: embeddings (pooled hidden states) and the
cross-encoders' label probabilities, each vs transformers."""

from engine.testing.models import ClassifierModelContract, EmbeddingModelContract


class TestBertModels(EmbeddingModelContract):
    model_class = "engine_models_bert.model:BertModel"


class TestBertClassifier(ClassifierModelContract):
    model_class = "engine_models_bert.classifier:BertForSequenceClassification"


class TestRobertaClassifier(ClassifierModelContract):
    model_class = "engine_models_bert.classifier:XLMRobertaForSequenceClassification"

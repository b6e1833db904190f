"""models-bert: BERT encoders for embeddings, BERT and XLM-RoBERTa cross-encoders for
classification and scoring (the pooling runner)."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("BertModel", "engine_models_bert.model:BertModel", api=2)
    classifiers = "engine_models_bert.classifier"
    register("BertForSequenceClassification", f"{classifiers}:BertForSequenceClassification", api=5)
    for architecture in ("XLMRobertaForSequenceClassification", "RobertaForSequenceClassification"):
        register(architecture, f"{classifiers}:XLMRobertaForSequenceClassification", api=5)

"""models-bert: BERT encoders for embeddings (the pooling runner)."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("BertModel", "engine_models_bert.model:BertModel", api=2)

"""The ground floor: what crosses between the layers of the engine. A request's parameters
(``SamplingParams``, ``PoolingParams``) and state (``Request``), the step messages between the
scheduler, the runner, the engine core and its front ends (``StepPlan``, ``StepResult``,
``EngineOutput``), the engine's statistics, KV cache events and the offline API's outputs.
Modules here import nothing of the engine above them."""

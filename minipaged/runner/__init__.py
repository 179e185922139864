"""The model runner: one step's scheduled chunks in, one ``ModelRunnerOutput`` out (vLLM v1's ``vllm/v1/worker/``).

One concept per module, named as vLLM's readers know them:

    model_runner.py   ``ModelRunner``: lays the chunks out as one flat batch (``ModelInput``) and runs the model
    input_batch.py    the persistent decode batch: block tables kept from step to step (vLLM's ``InputBatch``)
    executor.py       ``ModelExecutor.execute_model``: forward pass, logits stage, sampling, draft verification
    outputs.py        ``ModelRunnerOutput`` and ``StepTimes``: what a step's forward pass hands back

Nothing is imported here: this file runs for every importer of any of them, and ``outputs.py`` (read by the
observers' recorder) must not pull in torch and the model with it.
"""

"""Entry points for other trainers: the recipe's ``align`` flag and ``guards`` inside them.

* :class:`~.lightning.AlignmentCallback` (``megatron_vllm_align.integrations.lightning``): a
  Lightning callback (NeMo 2's trainer is a Lightning trainer) that refreshes the deployed vLLM
  weights after every optimizer step and runs the optimizer-identity, freeze and gradient-dump
  guards.
* :func:`~.spec_hook.transformer_layer_spec_hook` / :func:`~.spec_hook.align_config_overrides` /
  :func:`~.spec_hook.finish_aligned_model`: the ``transformer_layer_spec`` callable and the
  model post-build step that NeMo 2's ``GPTConfig`` and Megatron-Bridge's ``GPTModelProvider``
  take.

Neither Lightning nor NeMo is imported here; import the submodules directly.
"""

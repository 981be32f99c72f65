"""The RL math and data of a step: prompts in, per-token advantages and losses out (pure torch).

Parts (architecture.md §3 names the model-stages that produce their inputs):

* data:     ``tokenizer.CharTokenizer``, ``tasks.generate_tasks`` → JSONL, ``data.PromptDataset``
  (global sample order, DP shards via ``sample_range``), ``data.collate`` (left-padded prompts,
  G rows per prompt with distinct sample ids); ``verifiers`` turn responses into scores.
* PPO:      actor.gen → reward (verifier or reward.inf), ref.inf, actor.inf, critic.inf →
  ``advantages.token_rewards`` (score on the last token, KL to the reference in the reward) →
  ``advantages.gae`` → actor.train with ``losses.PolicyLoss``, critic.train with ``losses.ValueLoss``.
* GRPO:     G samples per prompt (``WorkloadSpec.samples_per_prompt``), no critic →
  ``advantages.grpo_advantages`` → ``losses.PolicyLoss(kl_coef > 0)`` (KL to ref.inf in the loss).
* ReMax:    one sampled and one greedy rollout per prompt, no critic →
  ``advantages.remax_advantages`` (greedy reward as baseline) → ``losses.PolicyLoss(kl_coef > 0)``
  (KL to ref.inf in the loss, as GRPO's; verl's ReMax example puts a k1 KL in the reward instead).

Submodules are imported explicitly; this package imports nothing, so ``tokenizer`` and ``tasks``
load without torch.
"""

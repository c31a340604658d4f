"""The rollout engine: ``num_generations`` completions of each prompt with ``generate``'s tokens (greedy) and
distribution (sampling), for less work (``generation``), its KV cache layers (``decode_cache``), the
attention that reads a prompt's KV once for its rows (``prefix_attention``) and the fixed-shape decode
steps a GPU replays as CUDA graphs (``decode_steps``).

Below ``train`` (whose rollouts sample with it) and ``integrations`` (``serve_generate`` puts it behind a
model's own ``generate``): it needs only the model (and ``models``' peft unwrapping)."""

"""The floor every other layer stands on: what fastalign needs to know about a Hugging Face causal LM,
and how a checkpoint streams into one. It imports nothing from fastalign, so ``losses``, ``data``,
``patching``, ``quant`` and ``train`` all import it downward.

Two modules, not one, because they serve different users: ``structure`` (the ignore index, peft
unwrapping, the decoder layers) is needed by the losses and the data collators, which should not pull in
the checkpoint loader's safetensors, accelerate and DTensor imports; ``streaming`` (``empty_model``,
``fill_model``, ``checkpoint_tensors``) is needed only where models are loaded.
"""

"""Layer 2, spec (pure Python, no MindSpore): the model config and presets, the parameter inventory and
HF <-> ms names, the LoRA spec, the MoE dispatch shapes, the parallel layout and the recipe schema."""

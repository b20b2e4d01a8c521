"""Memory, communication and time per GPU for a layout (t, p, d, ...): formulas, presets, planner.

* :mod:`.activations`: activation bytes of one layer, Korthikanti et al. 2022 and labkit's exact count.
"""
from .activations import korthikanti_layer_activation_bytes, layer_activation_bytes, torch_saved_bytes_per_element

__all__ = ["korthikanti_layer_activation_bytes", "layer_activation_bytes", "torch_saved_bytes_per_element"]

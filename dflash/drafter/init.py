"""`--drafter-init target`: a drafter that starts as the target's last decoder layers.

With little data (a CPU's half hour reads a few million tokens, against the hundreds of
millions the published drafters saw) a drafter initialized at random spends most of its
steps learning what the target already knows: attention over the target's states, an
MLP, and an output the target's LM head can read. Starting from the target's own last
`num_layers` layers gives it all three: each drafter layer takes the attention
projections, MLP and norms of one of them, the final norm is the target's (the one its
LM head reads after), and the fusion `fc` starts as the identity on the deepest captured
target layer (the others at zero), so the context the layers attend to is that layer's
residual stream, the input the copied layers were trained on. q/k norms the target lacks
start as the identity. On SmolLM2-135M it lowered the loss and raised τ at every step of
the recipe's run (docs/training.md).
"""

from __future__ import annotations

import torch

from dflash.drafter.model import DFlashDrafter, DrafterError
from dflash.target.layer_weights import decoder_layer_weights, final_norm_weight
from dflash.target.model import TargetModel


def target_layers_copied(num_drafter_layers: int, num_target_layers: int) -> list[int]:
    """The target layers drafter layers 0.. start from: its last ones, in order."""
    if num_drafter_layers > num_target_layers:
        raise DrafterError(
            f"--drafter-init target: {num_drafter_layers} drafter layers, but the target has "
            f"only {num_target_layers} to copy"
        )
    return list(range(num_target_layers - num_drafter_layers, num_target_layers))


def start_from_target(drafter: DFlashDrafter, target: TargetModel) -> list[int]:
    """Copies the target's last layers, final norm and a pass-through fusion into
    `drafter` (module docstring); -> the target layer ids copied. A layer whose shape
    differs (another --drafter-intermediate-size) is one line naming it."""
    cfg = drafter.config
    copied = target_layers_copied(cfg.num_layers, target.num_layers)
    own = drafter.state_dict()
    with torch.no_grad():
        for i, j in enumerate(copied):
            for name, tensor in decoder_layer_weights(target, j).items():
                key = f"layers.{i}.{name}"
                if key not in own:
                    continue  # e.g. a rotary buffer some targets keep in their layers
                if own[key].shape != tensor.shape:
                    raise DrafterError(
                        f"--drafter-init target: the target's layer {j} has {name} of shape "
                        f"{tuple(tensor.shape)}, the drafter {tuple(own[key].shape)} (a "
                        "drafter that starts as the target's layers keeps their widths: "
                        "leave --drafter-intermediate-size unset)"
                    )
                own[key].copy_(tensor)
        drafter.norm.weight.copy_(final_norm_weight(target))
        d = cfg.hidden_size
        fc = drafter.fc.weight  # [d, k*d]: the captured layers side by side, in id order
        fc.zero_()
        fc[:, fc.shape[1] - d :].copy_(torch.eye(d))
        drafter.hidden_norm.weight.fill_(1.0)
    return copied

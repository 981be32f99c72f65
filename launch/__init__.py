"""Login-node launcher (`nereus-launch`); must not import torch."""

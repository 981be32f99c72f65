"""Engines behind one protocol: ``protocol`` holds the ``Backend`` a runtime speaks and the types
it imports from here; ``registry`` names the engines (``torch_native`` now; Megatron-core for
training and vLLM for generation to come, on GPU nodes only) and builds one for a model-stage.

Importing this package (or ``registry``) does not import torch; building an engine does.
"""

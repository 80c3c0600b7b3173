"""Where a run's model comes from, beside ``mf.models``' presets: a transformers folder.

Owns reading a local causal-LM folder offline and building its model on the meta
device (``model_folder``) with the mask that keeps packed examples apart
(``example_mask``), each rank reading its own rows of the folder's
safetensors weights (``folder_weights``), and QLoRA's NF4 bases quantized per rank
(``nf4_bases``). The lowest room above ``settings``: it must not import any other
room of ``mf.train`` (data, reports, adapters, exports, run, rank).
"""

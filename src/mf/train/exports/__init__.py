"""The trained model outside mf, and transformers folders made or read for a run.

Owns the preset export and its loading and sampling (``export``), the fine-tuned
transformers folder (``folder_export``), peft's adapter folder and the merged model
(``adapter_export``), ``mf-sample`` (``sample``), and the small Llama folder made
locally to try ``--model PATH`` (``example_folder``, its tokenizer trained on
data's built-in corpus). Imports ``settings``, ``sources``, ``data`` and ``adapters``;
it must not import reports, run or rank.
"""

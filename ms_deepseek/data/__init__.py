"""Data: tokenizers, corpus readers, packing, MindRecord storage, training batches.

Importing this package is cheap; MindSpore loads only when shards are written
or read. Main entry points:

* :func:`ms_deepseek.data.tokenizer.load_tokenizer`
* :func:`ms_deepseek.data.chat.encode_chat` (DeepSeek-V2-Chat template)
* :func:`ms_deepseek.data.prepare.prepare_data`, :func:`~ms_deepseek.data.prepare.prepare_embedded_default`
* :func:`ms_deepseek.data.dataset.build_train_dataset`
* :class:`ms_deepseek.config.data.DataConfig` (the recipe's ``data:`` section)
"""

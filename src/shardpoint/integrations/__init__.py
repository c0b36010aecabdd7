"""Adapters for training frameworks. Each is an optional extra; the core never imports
them (``pip install 'shardpoint[lightning]'``)."""

"""The phone's drafters: the MTP head (``mtp``), the SLM (``slm``), their specs and shared layers.

``base.py`` (the ``Drafter`` protocol and result dataclasses) belongs to the tree builder.
"""

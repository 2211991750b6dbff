"""Shipped distribution-spec presets, stored as version-2 spec JSON.

Installed as ``jaxdd.specs``; read the files with
``importlib.resources.files("jaxdd.specs").joinpath("mpnn_halo.json")``.
"""

"""The papers' experiments at op level: :mod:`.sageattention3` (SageAttention3's NVFP4 attention,
as the two-scale-factor article measures it), :mod:`.mxattention` (MXAttention's UOS, PNQ and
ablation), :mod:`.robustness` (sharp inputs) and :mod:`.report` (the ``fp4video accuracy`` CLI)."""

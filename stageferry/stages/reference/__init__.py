"""Reference models for the two stages: small, untrained, but really computing and tensor-parallel.

Plug them in with ``module:factory``::

    [[stages]]
    name = "encoder"
    model = "stageferry.stages.reference.encoder:factory"    # job + media → conditioning payload
    tp = 2

    [[stages]]
    name = "diffusion"
    model = "stageferry.stages.reference.diffusion:factory"  # payload → MP4 (H.264 + AAC)
    tp = 4

Modules, one job each: ``tp`` (column/row-parallel layers, sharded attention and MLP), ``text_encoder``,
``vae`` (video latents ×8 spatial ×4 temporal, 16 channels), ``audio`` (32 kHz spectral latents),
``media_input`` (bytes → tensors, PyAV/Pillow), ``encoder`` (the encoder stage), ``dit`` (the
diffusion transformer), ``conditioning`` (pins, priors, reference tokens), ``sampler`` (flow-matching
Euler with guidance), ``diffusion`` (the diffusion stage) and ``mp4`` (writing and probing the output).
The payload between the stages follows the contract in ``stageferry.schemas.payload_contract`` (with
the layout metadata of ``schemas/payload_layout.py``).  Both stages must use the same weight ``seed``
(default 0) so that the diffusion stage's VAE decoder matches the encoder stage's VAE encoder.
"""

"""In-process diffusers pipelines behind `minisgl image`, `minisgl video` and the media HTTP routes.

Independent of the text engine: nothing here imports its model code, and torch/diffusers are
imported inside functions so that importing this package (and `minisgl --help`) stays cheap.
"""

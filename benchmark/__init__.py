"""The stocaching benchmark: a realistic JPEG -> decode -> cache -> augment -> small CNN pipeline.

Run ``python -m benchmark`` (a few minutes on 2 cores) or see ``python -m benchmark --help``.
It needs Pillow, matplotlib and tqdm besides torch (``benchmark/requirements.txt``).
"""

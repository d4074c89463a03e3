"""The tools that measure the project, run from the repository's root:

    python -m bench ...                 # the speed ladder (bench/speed.py); --sweep and --quality run the others
    python -m bench.trust ...           # how far to trust the shape score (bench/trust.py)

speed.py times the training step's speed-ups one row at a time, sweep.py times whole
train.py epochs across one setting, quality.py trains and scores the quality ladder's
rows, trust.py scores known image sets with the shape scorer. on_gpu.sh packs a GPU
session's runs; results/ holds the dated records.
"""

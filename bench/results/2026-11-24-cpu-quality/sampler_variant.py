# Score a run with a sampler variant that sample.py has no flag for (samplers.txt):
#   SAMPLER_VARIANT=karras|sde|sde_karras python sampler_variant.py RUN [sample.py args]
# Each variant is sample.make_scheduler's DPM-Solver++ with one setting changed; `sde` is
# what `--sampler dpmsolver_sde` builds since (this script predates that flag).
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository root
import sample  # noqa: E402

VARIANTS = {  # variant -> (the sampler it changes, the settings it changes)
    "karras": ("dpmsolver", dict(use_karras_sigmas=True)),
    "sde": ("dpmsolver_sde", {}),
    "sde_karras": ("dpmsolver_sde", dict(use_karras_sigmas=True)),
}
make_scheduler = sample.make_scheduler


def variant_scheduler(name, training_config):
    variant = os.environ.get("SAMPLER_VARIANT")
    if variant not in VARIANTS:
        return make_scheduler(name, training_config)
    base, changes = VARIANTS[variant]
    scheduler = make_scheduler(base, training_config)
    return type(scheduler).from_config(scheduler.config, **changes)


sample.make_scheduler = variant_scheduler
sys.exit(sample.main(sample.parse_args(sys.argv[1:])))

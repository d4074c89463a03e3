# Score a run with a sampler variant: SAMPLER_VARIANT=karras|sde|sde_karras|noclip python sampler_variant.py RUN [sample.py args]
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..'))  # the repository root
import sample
orig = sample.make_scheduler
def patched(name, cfg):
    from diffusers import DPMSolverMultistepScheduler, DDPMScheduler, EulerAncestralDiscreteScheduler, DPMSolverSDEScheduler
    v = os.environ.get('SAMPLER_VARIANT', '')
    if v == 'karras':
        return DPMSolverMultistepScheduler.from_config(cfg, algorithm_type="dpmsolver++", solver_order=2, thresholding=True,
            sample_max_value=1.0, use_karras_sigmas=True, lower_order_final=True, final_sigmas_type="zero")
    if v == 'sde':
        return DPMSolverMultistepScheduler.from_config(cfg, algorithm_type="sde-dpmsolver++", solver_order=2, thresholding=True,
            sample_max_value=1.0, timestep_spacing="trailing", lower_order_final=True, final_sigmas_type="zero")
    if v == 'sde_karras':
        return DPMSolverMultistepScheduler.from_config(cfg, algorithm_type="sde-dpmsolver++", solver_order=2, thresholding=True,
            sample_max_value=1.0, use_karras_sigmas=True, lower_order_final=True, final_sigmas_type="zero")
    if v == 'noclip':
        return DPMSolverMultistepScheduler.from_config(cfg, algorithm_type="dpmsolver++", solver_order=2, thresholding=False,
            timestep_spacing="trailing", lower_order_final=True, final_sigmas_type="zero")
    return orig(name, cfg)
sample.make_scheduler = patched
sys.exit(sample.main(sample.parse_args(sys.argv[1:])))

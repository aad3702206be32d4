"""The planner: the peak of a `generate()` call before it runs, above the lesson's modules and below the lab, the
savers and the command line.

    sources  a config and a model from a preset, a local config.json or a hub id (`load_config`, `build_model`:
             `kvlab.build_model`); a config kvlab cannot decode with refused (`check_decoder`)
    theory   kvlab.theory's walk on a CUDA GPU (SDPA's kernels, the caching allocator's blocks, cuBLAS's workspace)
             and for transformers' exported program: `predict_overhead`, `breakdown` on any device
    params   a point's parameters checked in one place, defaults filled (`normalize`); the device a prediction
             plans for, whatever this machine has (`target_device`, `target_threads`, `target_arch`)
    meta     the CPU or a CUDA GPU on the meta device (`MetaAsCpu`, `MetaAsCuda`), and the CPU's kernel library a
             prediction names
    dry_run  kvlab's loop on meta, the forward only at the steps that can hold the peak (`dry_run`, `DryRun`)
    fast     that dry run of a model cut to a few layers, extrapolated to all (`FastDryRun`): predict's default
    scans    the fast dry run's short scans: a reference kernel's loop over a prompt's chunks run for two of them
    plan     `predict` (kvlab.theory's walk or a dry run per design, "does it fit", the largest batch and
             generation), `Prediction` and its table, `check_fits`

`kvlab.predict` is `kvlab.planner.plan.predict`.
"""

"""The experiment machinery around the lesson: one point schema, one store, one runner, two engines.

    configs     a model's config from a preset, config.json or hub id, overrides checked
    point       one measured point: parameters in (validated in one place), one flat record out
    grid        sweep files and --grid items → points, with stable ids
    store       each point's row in records/, results.csv made from them (file-locked), resume, provenance
    runner      one point: the point notebook under papermill in a fresh kernel → a row; failure statuses
    engines     the sweep driver and the local engine; ray_engine: a Ray task per point
    reference   the real releases' own generate(), each in its own folder, in a subprocess
    predict     the predicted peak before running, and "does it fit"
    compare     the main job (`make compare`): a shipped sweep, its table and figures
    waste_table kvlab.waste's tables stored in data/today, with their provenance (`python -m kvlab waste`)
    cli         `python -m kvlab {measure,predict,compare,explain,sweep,waste}`

How sweeps run, resume and fail: README.md, "Sweeps".
"""

"""The experiment machinery around the lesson: one point schema, one store, one runner, two engines.

    point       one measured point: parameters in (validated in one place), one flat record out
    grid        sweep files and --grid items → points, with stable ids
    store       each point's row in records/, results.csv made from them (file-locked), resume, provenance
    runner      one point: the point notebook under papermill in a fresh kernel → a row; failure statuses
    engines     the sweep driver and the local engine; ray_engine: a Ray task per point
    reference   the real releases' own generate(), each in its own folder, in a subprocess
    predict     the predicted peak before running, and "does it fit"
    compare     the main job (`make compare`): a shipped sweep, its table and figures
    cli         `python -m kvlab {measure,predict,compare,sweep,stream}`; sweep_cli: the sweep's own options

    python -m kvlab sweep cpu-default --out results/cpu-default
    python -m kvlab sweep --grid cache=tuple,dynamic --grid new=64,128 --out results/mine
    python -m kvlab sweep cpu-default --engine ray [--address auto|ray://HOST:PORT]

Each point executes the point notebook in a new kernel, so one point's memory (or crash) never leaks
into the next. Rerunning the same command skips the points already measured (status "ok"); a point that
ran out of memory or failed becomes a row with its status and error, and the sweep goes on.
"""

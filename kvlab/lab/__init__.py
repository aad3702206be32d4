"""The experiment machinery around the lesson: one point, one store, one runner, two engines.

    point       one measured point: parameters in, one flat record out
    provenance  where a record was measured: device, versions, commit, time
    grid        sweep files and --grid items → points, with stable ids; shipped: a sweep file by name or path
    store       each point's row in records/ (the one truth), results.csv remade from them (file-locked), provenance
    kernel      the Jupyter kernel papermill runs notebooks with
    runner      one point: the point notebook under papermill in a fresh kernel → a row; failure statuses
    engines     the sweep driver and the local engine; ray_engine: a Ray task per point
    summary     a sweep's table at its longest generation (OUT/summary.md, and what `make compare` prints)
    reference   the worker kvlab.releases runs a real release's own generate() in; SHOWCASE, where releases differ most
    waste_table kvlab.waste's tables stored in data/today, with their provenance (`python -m kvlab waste`)
    savers_table  kvlab.savers' tables and the running example's answers with each lossy saver (`kvlab savers`)

Below it: kvlab.planner (a point's parameters checked, the predicted peak, "does it fit"). Above it: kvlab.compare
(the main job) and kvlab.cli (`python -m kvlab ...`). How sweeps run, resume and fail: docs/sweeps.md.
"""

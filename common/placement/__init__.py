"""Expert placement: routing statistics (`stats`), device specs (`devices`), the cost model (`cost`),
the planner (`plan`), placement files (`placement_file`), the startup memory budget (`budget`) and
the per-worker weight bytes of a checkpoint (`worker_sizes`, for `moemesh check-model`).

Everything here is pure Python (no torch at import), because the router reads placements. Nothing is imported
by this package file, so importing one submodule stays cheap.
"""

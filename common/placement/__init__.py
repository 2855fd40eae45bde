"""Expert placement: routing statistics (`stats`), device specs (`devices`), the cost model (`cost`),
the planner (`plan`), placement files (`placement_file`) and the startup memory budget (`budget`).

Everything here is pure Python (no torch), because the router reads placements. Nothing is imported
by this package file, so importing one submodule stays cheap.
"""

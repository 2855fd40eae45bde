"""Sub-commands of `moemesh`; each module defines add_arguments(parser, name) and run(args)."""

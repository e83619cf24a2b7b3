"""Research beside the engine: the OPTIPIPE / OptiFork diagnostic door (`research.optipipe`, reached by the round
through `engine.spec.ROUND_HOOK` only while armed) and DSpark supervision records (`research.dspark`), with their
CLI subcommands (`research.commands`). Research imports the engine; the engine never imports research."""

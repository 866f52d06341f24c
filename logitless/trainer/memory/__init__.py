"""Device memory: the plan of each phase's peak (`plan`), its view of a model (`model`) and of N ranks (`ranks`),
the settings left "auto" (`auto`) and the one out-of-memory retry (`oom`)."""

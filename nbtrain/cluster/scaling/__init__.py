"""`%nbtrain scaling`: the sweep over 1, 2, 4... nodes, the scaling model fitted to it, and its report."""

"""Engine-agnostic tree verification core (torch only): token trees, p̃, exact and ε acceptance."""

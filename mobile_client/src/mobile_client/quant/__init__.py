"""W4 per-channel weights with a clipping search, A16 fixed-range activations, and QAT of the MTP head."""

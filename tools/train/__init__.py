"""Training of the embedded default model (kjv-dsv4-mini): target + DSpark drafter + export."""

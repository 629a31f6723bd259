"""Evidence integrity: the output folder, its evidence set, its outputs, digests and verification."""

-- The evidence set an output folder holds: the incident file and every input file (by SHA-256) its
-- evidence was built from. A run whose inputs differ rebuilds the evidence (or, asked to, appends).
CREATE TABLE IF NOT EXISTS evidence_set (
    incident_file     VARCHAR NOT NULL,       -- absolute path of the incident file
    incident_sha256   VARCHAR NOT NULL
);

CREATE TABLE IF NOT EXISTS evidence_inputs (
    source            VARCHAR NOT NULL,
    file              VARCHAR NOT NULL,       -- absolute path
    sha256            VARCHAR NOT NULL
);

# R 4.2.2 / DESeq2 1.38.3: estimateSizeFactors(type = "iterate") (estimateSizeFactorsIterate: rounds of
# estimateDispersions(fitType = "mean") and optim's L-BFGS-B on the trimmed log-likelihood), as C99 hex floats, for
# tests/deseq/test_deseq_reference.py.
#   iterate_pasilla.csv  pasilla, every 10th gene: the size factors
#   iterate_sim_counts.csv, iterate_sim.csv  simulated NB counts (seed 7, 400 genes x 12 samples, dispersion 0.1,
#                        20% of the genes without a count in half the samples) and their size factors
# Run: Rscript make_iterate_reference.R <gpuc>/src/gpuc/datasets/data
suppressMessages(library(DESeq2))
args <- commandArgs(trailingOnly = TRUE)
src <- if (length(args)) args[1] else "src/gpuc/datasets/data"
hx <- function(v) sprintf("%a", v)
pc <- as.matrix(read.csv(gzfile(file.path(src, "pasilla_counts.csv.gz")), row.names = 1))
pc <- pc[seq(1, nrow(pc), by = 10), ]
dds <- DESeqDataSetFromMatrix(pc, data.frame(row.names = colnames(pc), x = rep(1, ncol(pc))), ~1)
dds <- estimateSizeFactors(dds, type = "iterate")
write.csv(data.frame(sample = colnames(pc), sf = hx(sizeFactors(dds))), "iterate_pasilla.csv", row.names = FALSE, quote = FALSE)

set.seed(7)
G <- 400; n <- 12
mu <- exp(rnorm(G, 4, 1.5)); sf <- exp(rnorm(n, 0, 0.4))
cts <- matrix(rnbinom(G * n, mu = outer(mu, sf), size = 10), G, n, dimnames = list(paste0("g", 1:G), paste0("s", 1:n)))
cts[sample.int(G, G / 5), 1:(n / 2)] <- 0L
write.csv(cts, "iterate_sim_counts.csv", quote = FALSE)
dds <- DESeqDataSetFromMatrix(cts, data.frame(row.names = colnames(cts), x = rep(1, n)), ~1)
dds <- estimateSizeFactors(dds, type = "iterate")
write.csv(data.frame(sample = colnames(cts), sf = hx(sizeFactors(dds))), "iterate_sim.csv", row.names = FALSE, quote = FALSE)

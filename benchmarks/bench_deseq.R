# R DESeq2 side of benchmarks/bench_deseq.py:
#   Rscript benchmarks/bench_deseq.R counts.csv metadata.csv results_out.csv timing_out.csv
# counts.csv: genes x samples (first column gene id); metadata.csv: samples (first column id) with `condition`.
suppressMessages(library(DESeq2))
args <- commandArgs(trailingOnly = TRUE)
cpu <- function() { pt <- proc.time(); pt[["user.self"]] + pt[["sys.self"]] }
t0 <- proc.time()[["elapsed"]]
cts <- as.matrix(read.csv(args[1], row.names = 1, check.names = FALSE))
md <- read.csv(args[2], row.names = 1)
md$condition <- factor(md$condition, levels = c("A", "B"))
t1 <- proc.time()[["elapsed"]]; c1 <- cpu()
dds <- DESeqDataSetFromMatrix(cts, md, ~ condition)
dds <- DESeq(dds, quiet = TRUE)
t2 <- proc.time()[["elapsed"]]; c2 <- cpu()
res <- results(dds, contrast = c("condition", "B", "A"))
t3 <- proc.time()[["elapsed"]]; c3 <- cpu()
write.csv(as.data.frame(res), args[3])
write.csv(data.frame(stage = c("read", "DESeq", "results"), seconds = c(t1 - t0, t2 - t1, t3 - t2),
                     cpu_seconds = c(c1, c2 - c1, c3 - c2),
                     version = as.character(packageVersion("DESeq2"))), args[4], row.names = FALSE)

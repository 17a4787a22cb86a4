# Regenerates the R references of tests/deseq/test_prefit.py, test_rlog.py and test_transform_figures.py with Debian's R 4.2.2, r-bioc-deseq2 (DESeq2 1.38.3)
# and r-bioc-edger (edgeR 3.40.2):
#   Rscript tests/data/deseq/prefit/make_reference.R src/gpuc/datasets/data tests/data/deseq/prefit
# Two data sets: pasilla (7 samples, design ~condition) and a pbmc3k CD14+ monocyte pseudobulk (24 random
# pseudo-donors, 12 "ctrl" and 12 "stim", design ~group; written by make_pbmc_pseudobulk.py in this folder).
# For each: rlog(blind=TRUE) and rlog(blind=FALSE) after DESeq() on all genes (every 10th gene written, with the
# betaPriorVar and rlogIntercept, the size factors and both parametric trends), and edgeR's filterByExpr(group=) at its defaults on all genes.
suppressMessages({
  library(DESeq2)
  library(edgeR)
})
args <- commandArgs(trailingOnly = TRUE)
src <- args[1]; out <- args[2]

sets <- list(
  pasilla = list(
    counts = file.path(src, "pasilla_counts.csv.gz"), meta = file.path(src, "pasilla_metadata.csv"),
    factor = "condition", levels = c("untreated", "treated")
  ),
  pbmc_cd14 = list(
    counts = file.path(out, "pbmc_cd14_counts.csv.gz"), meta = file.path(out, "pbmc_cd14_metadata.csv"),
    factor = "group", levels = c("ctrl", "stim")
  )
)
globals <- list()
for (name in names(sets)) {
  s <- sets[[name]]
  cts <- as.matrix(read.csv(gzfile(s$counts), row.names = 1, check.names = FALSE))
  md <- read.csv(s$meta, row.names = 1, check.names = FALSE)
  md <- md[colnames(cts), , drop = FALSE]
  cd <- data.frame(f = factor(md[[s$factor]], levels = s$levels), row.names = rownames(md))
  # edgeR filterByExpr on the raw counts, defaults (min.count 10, min.total.count 15, large.n 10, min.prop 0.7)
  keep <- filterByExpr(cts, group = cd$f)
  write.csv(data.frame(gene_id = rownames(cts), keep = keep), gzfile(file.path(out, paste0("filterByExpr_", name, "_R.csv.gz"))),
            row.names = FALSE)
  dds <- DESeqDataSetFromMatrix(cts, cd, ~f)
  t0 <- proc.time()[["elapsed"]]
  rb <- rlog(dds, blind = TRUE)
  t_blind <- proc.time()[["elapsed"]] - t0
  dds <- DESeq(dds, quiet = TRUE)
  t0 <- proc.time()[["elapsed"]]
  rd <- rlog(dds, blind = FALSE)
  t_design <- proc.time()[["elapsed"]] - t0
  rows <- seq(1, nrow(cts), by = 10)
  # normalised counts, fpm (robust and not) on the same rows; plotPCA(returnData=TRUE) of both rlogs (ntop = 500)
  # and plotCounts(returnData=TRUE) of the gene with the smallest p-value
  norm <- cbind(counts(dds, normalized = TRUE)[rows, ], fpm(dds)[rows, ], fpm(dds, robust = FALSE)[rows, ])
  colnames(norm) <- c(paste0("normalized_", colnames(cts)), paste0("fpm_", colnames(cts)), paste0("fpmraw_", colnames(cts)))
  write.csv(signif(norm, 10), gzfile(file.path(out, paste0("normalized_", name, "_R.csv.gz"))))
  pcs <- list()
  for (m in c("blind", "design")) {
    p <- plotPCA(if (m == "blind") rb else rd, intgroup = "f", returnData = TRUE)
    pcs[[m]] <- data.frame(mode = m, sample = p$name, PC1 = p$PC1, PC2 = p$PC2, percentVar1 = attr(p, "percentVar")[1],
                           percentVar2 = attr(p, "percentVar")[2])
  }
  write.csv(do.call(rbind, pcs), file.path(out, paste0("plotPCA_", name, "_R.csv")), row.names = FALSE)
  top <- rownames(dds)[which.min(results(dds)$pvalue)]
  pc <- plotCounts(dds, gene = top, intgroup = "f", returnData = TRUE)
  write.csv(data.frame(gene = top, sample = rownames(pc), count = pc$count, group = pc$f),
            file.path(out, paste0("plotCounts_", name, "_R.csv")), row.names = FALSE)
  vb <- assay(rb)[rows, ]; colnames(vb) <- paste0("blind_", colnames(vb))
  vd <- assay(rd)[rows, ]; colnames(vd) <- paste0("design_", colnames(vd))
  tab <- data.frame(
    vb, vd, check.names = FALSE,
    blind_intercept = mcols(rb)$rlogIntercept[rows], design_intercept = mcols(rd)$rlogIntercept[rows]
  )
  write.csv(signif(tab, 10), gzfile(file.path(out, paste0("rlog_", name, "_R.csv.gz"))))
  cb <- attr(dispersionFunction(estimateDispersionsFit(estimateDispersionsGeneEst(
    estimateSizeFactors(DESeqDataSetFromMatrix(cts, cd, ~1)), quiet = TRUE), quiet = TRUE)), "coefficients")
  cd_ <- attr(dispersionFunction(dds), "coefficients")
  # rlog(blind=FALSE) reads baseMean and dispFit from mcols(dds): after DESeq() they come from the counts with Cook's
  # outliers replaced (refitted genes), not from counts(dds)
  write.csv(signif(data.frame(baseMean = mcols(dds)$baseMean, dispFit = mcols(dds)$dispFit, row.names = rownames(dds)), 12),
            gzfile(file.path(out, paste0("mcols_", name, "_R.csv.gz"))))
  write.csv(data.frame(sample = colnames(cts), size_factor = sizeFactors(dds)),
            file.path(out, paste0("size_factors_", name, "_R.csv")), row.names = FALSE)
  globals[[name]] <- data.frame(
    set = name, blind_asymptDisp = cb[["asymptDisp"]], blind_extraPois = cb[["extraPois"]],
    design_asymptDisp = cd_[["asymptDisp"]], design_extraPois = cd_[["extraPois"]], blind_betaPriorVar = attr(rb, "betaPriorVar"), design_betaPriorVar = attr(rd, "betaPriorVar"),
    blind_seconds = t_blind, design_seconds = t_design, n_kept_filterByExpr = sum(keep),
    DESeq2 = as.character(packageVersion("DESeq2")), edgeR = as.character(packageVersion("edgeR"))
  )
}
write.csv(do.call(rbind, globals), file.path(out, "globals_R.csv"), row.names = FALSE)
